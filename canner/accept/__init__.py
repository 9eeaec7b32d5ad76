"""One acceptance for every door: the door-neutral intake (admission of a body, its append and
finish), the commit sequence, and the origin rule (a copy of an accepted file is that file)."""
