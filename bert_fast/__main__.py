"""``python -m bert_fast``: the same CLI as the ``bert-fast`` console script."""

import sys

from bert_fast.cli import main

if __name__ == "__main__":
    sys.exit(main())
