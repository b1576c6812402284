"""`python tools/report.py` = `mpp-report` (mpp/tools/report.py has the arguments and the main)."""
from mpp.tools.report import main

if __name__ == "__main__":
    main()
