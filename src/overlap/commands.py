def register_commands(sub):
    pass
