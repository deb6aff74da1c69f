"""`python -m launcher ...` is the `launch` command."""

from launcher.host.cli import entry

if __name__ == "__main__":
    entry()
