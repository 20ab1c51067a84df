"""``python -m flexpipe_dag.cli``: the ``flexpipe`` command, for launchers that take a module
(``deepspeed --module flexpipe_dag.cli``, ``torch.distributed.run -m flexpipe_dag.cli``)."""

import sys

from flexpipe_dag.cli import main

sys.exit(main())
