"""`python -m launcher ...` is the `launch` command."""

from launcher.host.cli import main

if __name__ == "__main__":
    main()
