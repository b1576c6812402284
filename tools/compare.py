"""`python tools/compare.py` = `mpp-compare` (mpp/tools/compare.py has the arguments and the main)."""
from mpp.tools.compare import main

if __name__ == "__main__":
    main()
