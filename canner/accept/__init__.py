"""One acceptance for every door: the commit sequence, and the origin rule (a copy of an
accepted file is that file)."""
