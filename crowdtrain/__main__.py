"""`python -m crowdtrain` is the same as the `crowdtrain` command."""

from crowdtrain.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
