"""The paper's two tasks: EXor (synthetic, `tasks.exor`) and BookCorpus with twin tokens (`tasks.bookcorpus`)."""
