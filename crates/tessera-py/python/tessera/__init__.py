from ._tessera import *  # noqa
