"""`python -m h3trt.cli ...`, as the `h3trt` script (torchrun launches ranks this way)."""

import sys

from . import main

sys.exit(main())
