import signal
import sys

if hasattr(signal, "pthread_sigmask"):  # held until the command's handlers exist (cli.main unblocks them there)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

from jaxquant.cli import main  # noqa: E402

sys.exit(main())
