"""`python tools/linear_probe.py` = `mpp-probe` (mpp/tools/linear_probe.py has the arguments and the main)."""
from mpp.tools.linear_probe import main

if __name__ == "__main__":
    main()
