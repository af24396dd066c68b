"""`python -m server [MODEL] [flags]`: the same as `kiln serve`."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
