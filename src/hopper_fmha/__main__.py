import sys

from hopper_fmha.cli import main

sys.exit(main())
