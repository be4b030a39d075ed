"""The layouts a world can train in (:mod:`.layouts`), ranked by a throughput model (:mod:`.throughput`), measured in
waves over workers (:mod:`.waves`, :mod:`.workers`), and the fastest that fits chosen (:mod:`.fitting`)."""
