"""`python -m clipcli`: the same entry point as the `clipcli` command."""

from clipcli.cli import main

if __name__ == "__main__":
    main()
