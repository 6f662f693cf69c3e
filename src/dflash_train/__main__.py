"""`python -m dflash_train ...` (what `torchrun -m dflash_train` runs)."""

from dflash_train.cli import main

raise SystemExit(main())
