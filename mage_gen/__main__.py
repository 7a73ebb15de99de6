from mage_gen.cli import main

# Guarded: the tuner's spawned worker process imports this module again and must not rerun the CLI.
if __name__ == "__main__":
    main()
