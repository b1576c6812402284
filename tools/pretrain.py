"""`python tools/pretrain.py` = `mpp-pretrain` (mpp/tools/pretrain.py has the arguments and the main)."""
from mpp.tools.pretrain import main

if __name__ == "__main__":
    main()
