"""The real image datasets: file readers, the decoded-array cache, and the safe CIFAR pickle reader.

Each loader takes the data root (a folder holding one sub-folder per dataset) and an optional cache
folder, and returns the official train and test sets in their standard order as uint8
N x C x H x W images and int64 labels. `fedcore.data` registers them by name and adds the
transforms; a missing or malformed dataset raises `DataError` naming the files it expected and where.
"""
