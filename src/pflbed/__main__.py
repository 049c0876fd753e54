import sys

from pflbed.cli import main

sys.exit(main())
