from mage_gen.cli import main

main()
