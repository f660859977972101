"""The checks more than one module makes, with their messages (`_checks`), and what several modules' messages
share (`_messages`): how values are written, and the messages raised in two places."""
