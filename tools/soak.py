"""`python tools/soak.py` = `mpp-soak` (mpp/tools/soak.py has the arguments and the main)."""
from mpp.tools.soak import main

if __name__ == "__main__":
    main()
