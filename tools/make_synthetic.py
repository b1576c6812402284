"""`python tools/make_synthetic.py` = `mpp-make-synthetic` (mpp/tools/make_synthetic.py has the
arguments and the main)."""
from mpp.tools.make_synthetic import main

if __name__ == "__main__":
    main()
