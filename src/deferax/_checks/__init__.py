"""Every user-facing message (`_messages`) and the checks that raise them (`_checks`)."""
