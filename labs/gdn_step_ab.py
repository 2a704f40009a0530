"""``sharpi bench`` with the one-token Gated DeltaNet kernels (``step_kernels.delta_net_step`` and
``gated_norm``) replaced by the reference layer's torch ops in the device step: the A side of an A/B whose B
side is the same command through ``sharpi bench``.

  PYTHONPATH=. python3 labs/gdn_step_ab.py -m F --prompt 512 --gen 64 --device cuda --json --vram 12GiB --moe cpu
"""

import sys

from engine.cli.main import main
from engine.models.ops import TorchOps
from engine.runtime.step_ops import DeviceStepOps

DeviceStepOps.delta_net = TorchOps.delta_net
DeviceStepOps.gated_norm = TorchOps.gated_norm

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
