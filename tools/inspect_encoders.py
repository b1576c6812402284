"""`python tools/inspect_encoders.py` = `mpp-inspect` (mpp/tools/inspect_encoders.py has the arguments and the main)."""
from mpp.tools.inspect_encoders import main

if __name__ == "__main__":
    main()
