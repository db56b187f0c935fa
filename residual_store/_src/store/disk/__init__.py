"""The store's files: contexts' write plans, manifests and data (the disk tier), the forms a
residual takes on disk, the tree's paths, and the media below them (a local folder, a
tensorstore kvstore) with the strategy each makes its writes atomic by."""
