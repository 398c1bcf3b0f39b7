"""`python -m flashformer.cli` (as torchrun runs it): the `flashformer` command."""

import sys

from flashformer.cli.commands import main

sys.exit(main())
