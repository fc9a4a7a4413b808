"""Images: recipes built into content-addressed rootfs archives both runtimes boot."""
