"""An object whose unpickling makes a directory: what a pickled entry in a file pflbed reads (a site's samples, a
node's kept state) could run instead. A test plants it, reads the file, and checks the directory never appears."""

import os


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)
