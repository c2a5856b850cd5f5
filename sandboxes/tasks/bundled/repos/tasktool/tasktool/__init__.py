"""tasktool: a command-line to-do list stored in one JSON file."""

__version__ = "0.9.0"
