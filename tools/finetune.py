"""`python tools/finetune.py` = `mpp-finetune` (mpp/tools/finetune.py has the arguments and the main)."""
from mpp.tools.finetune import main

if __name__ == "__main__":
    main()
