"""The error a user's data causes."""


class DataError(ValueError):
    """Data a user pointed at cannot be used; the message is one line naming the data.* key."""
