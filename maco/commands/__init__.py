"""One module per `maco` subcommand."""
