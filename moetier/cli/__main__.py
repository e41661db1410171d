import sys

from moetier.cli import main

sys.exit(main())
