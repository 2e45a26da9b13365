import sys

from omforge.cli import main

sys.exit(main())
