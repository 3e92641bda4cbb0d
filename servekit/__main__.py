import sys

from servekit.cli import main

sys.exit(main())
