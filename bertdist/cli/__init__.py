"""The `bertdist` command line: one module per subcommand, wired in main.py."""
