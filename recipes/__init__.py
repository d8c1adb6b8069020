"""untie_recipes: the paper reproductions that ship beside the library, not inside it.

`untie` (the library) never imports this package. It holds what the recipes in this folder share with the tests and
examples: the EXor and BookCorpus tasks (data, twin tokens, models; `untie_recipes.tasks`), the shipped offline corpus
and tokenizer, the paper's learning-rate schedule (`untie_recipes.schedules`) and the examples' offline data
(`untie_recipes.offline`). `pip install -e .` from a clone installs it as `untie_recipes`, mapped to `recipes/`.
"""
