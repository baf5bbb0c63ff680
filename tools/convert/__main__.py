import sys

from tools.convert.cli import main

sys.exit(main())
