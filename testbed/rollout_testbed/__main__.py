import sys

from rollout_testbed.cli import main

sys.exit(main())
