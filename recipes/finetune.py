"""Recover a converted model against its original: ``hf_normswap.training.recipe``, as a file to launch.

    accelerate launch recipes/finetune.py --config recipes/configs/smollm2-eln.yaml
    accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml recipes/finetune.py --config ...
    python recipes/finetune.py --config recipes/configs/smollm2-eln.yaml training.max_steps=50 max_minutes=10

The same run as ``normswap recover --config FILE [key=value ...]``.
"""

import sys

from hf_normswap.training.recipe import main

if __name__ == "__main__":
    sys.exit(main())
