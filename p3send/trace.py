"""(being written)"""


def add_arguments(p):
    pass


def main(args):
    from .errors import P3SendError
    raise P3SendError("trace: not built yet")
