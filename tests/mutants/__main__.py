import sys

from tests.mutants import main

raise SystemExit(main(sys.argv[1:]))
