import sys

from keras_dpsgd.cli import main

sys.exit(main())
