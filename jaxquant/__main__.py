import sys

from jaxquant.cli import main

sys.exit(main())
