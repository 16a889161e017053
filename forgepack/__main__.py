from forgepack.cli import main

main()
