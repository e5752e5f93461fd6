"""The data tests' tokenizer: one token per whitespace-separated word, so that a prompt's length can be read off its text."""


def words(text: str) -> int:
    """The number of whitespace-separated words in ``text``."""
    return len(text.split())
