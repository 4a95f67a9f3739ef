"""Turning member bytes into values and back.

``registry``  the codec registry (decode/encode by extension, optional codecs declared by name)
``images``    image decoding and modes, the JPEG fast paths
``crop``      random resized crops fused into JPEG decoding
``decoding``  the decode stage (and the fused ``decode`` + ``to_tuple`` pass)

Audio and video clips are :mod:`tarshards.media`.
"""
