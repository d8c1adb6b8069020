"""`python -m untie`: the same command line as the installed `untie` entry point."""

import sys

from untie.cli import main

sys.exit(main())
