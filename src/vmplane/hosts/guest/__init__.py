"""The small test guest: a Debian cloud kernel and a busybox initramfs, built once into a cache folder."""
