"""The commands of ``privprompt`` by group (``privprompt_cli.py`` holds the parser and dispatch)."""
