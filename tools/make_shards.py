"""`python tools/make_shards.py` = `mpp-make-shards` (mpp/tools/make_shards.py has the arguments and the main)."""
from mpp.tools.make_shards import main

if __name__ == "__main__":
    main()
